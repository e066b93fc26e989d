"""``hvdlite-run --config-file``: horovodrun's YAML settings file; flags given on the command line win over it."""
from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..core.launch import LOG_LEVELS

#: Sections of horovodrun's YAML file and, for each key, the hvdlite-run flag (argparse dest) it sets.
SECTIONS: dict[str, dict[str, str]] = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file", "warmup_samples": "autotune_warmup_samples",
                 "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "no_stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable", "num_nccl_streams": "num_nccl_streams",
                        "ccl_bgt_affinity": "ccl_bgt_affinity", "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level", "with_timestamp": "log_hide_time"},
}
#: Keys whose meaning is the opposite of the flag they set (stall_check.enabled vs --no-stall-check, ...).
_INVERTED = {("stall_check", "enabled"), ("logging", "with_timestamp")}
_NUMBERS = {"fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "stall_check_warning_time_seconds",
            "stall_check_shutdown_time_seconds", "autotune_warmup_samples", "autotune_steps_per_sample",
            "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise"}


class ConfigFileError(ValueError):
    """A --config-file that cannot be read or holds a value of the wrong kind."""


def load(path: str) -> Mapping[str, Any]:
    try:
        import yaml
    except ImportError:
        raise ConfigFileError(f"--config-file {path}: reading YAML needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except OSError as exc:
        raise ConfigFileError(f"--config-file {path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config-file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config-file {path}: expected a mapping of sections (params, timeline, ...), "
                              f"got {type(data).__name__}")
    return data


def apply_config_file(args: argparse.Namespace, path: str) -> list[str]:
    """Set every flag the file gives that the command line left unset; return notes on keys it ignores."""
    data = load(path)
    notes: list[str] = []
    for section, values in data.items():
        if section == "controller":
            if str(values).lower() == "gloo" and not args.use_mpi:
                args.use_gloo = True
            elif str(values).lower() != "mpi":
                raise ConfigFileError(f"--config-file {path}: controller {values!r} is not one hvdlite has; use mpi")
            continue
        keys = SECTIONS.get(section)
        if keys is None:
            notes.append(f"--config-file {path}: unknown section {section!r} is ignored")
            continue
        if not isinstance(values, dict):
            raise ConfigFileError(f"--config-file {path}: section {section!r} must be a mapping, got {values!r}")
        if section == "autotune" and not values.get("enabled", False):
            continue  # horovodrun reads the other autotune keys only when autotune is enabled
        for key, value in values.items():
            dest = keys.get(key)
            if dest is None:
                notes.append(f"--config-file {path}: unknown key {section}.{key} is ignored")
                continue
            if value is None or getattr(args, dest, None) is not None:
                continue  # given on the command line: the command line wins
            if (section, key) in _INVERTED:
                if not isinstance(value, bool):
                    raise ConfigFileError(f"--config-file {path}: {section}.{key} must be true or false, got {value!r}")
                value = not value
            elif dest in _NUMBERS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigFileError(f"--config-file {path}: {section}.{key} must be a number >= 0, "
                                          f"got {value!r}")
            elif dest == "log_level":
                value = str(value).upper()
                if value not in LOG_LEVELS:
                    raise ConfigFileError(f"--config-file {path}: logging.level must be one of "
                                          f"{', '.join(LOG_LEVELS)}, got {values[key]!r}")
            setattr(args, dest, value)
    return notes
