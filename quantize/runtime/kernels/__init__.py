"""qpack's native CPU kernels: C++ sources in `csrc/` (shipped with the package), compiled once per machine by
`build`, called through `ops` (which raises a clear error when they are not loaded)."""
