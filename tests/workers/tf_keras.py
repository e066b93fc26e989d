"""Runs tf_collectives.py, then keras_fit.py, in one process: TensorFlow is imported once per launch."""
import runpy
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
tmp = Path(sys.argv[1])
for script, arg in (("tf_collectives.py", tmp / "timeline.json"), ("keras_fit.py", tmp)):
    sys.argv = [str(here / script), str(arg)]
    runpy.run_path(str(here / script), run_name="__main__")
