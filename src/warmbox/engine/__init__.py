"""Engine: sandbox lifecycle, registry-backed state, timings; no isolation code lives here."""
