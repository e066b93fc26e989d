"""The engine: one background thread per process that runs every tensor collective (docs/ARCHITECTURE.md reads
it module by module). Nothing outside hvdlite.core may import this package."""
