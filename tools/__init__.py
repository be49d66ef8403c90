"""The project's benchmarks, checks and generators. Each script runs from the repository root as
`python -m tools.NAME` (`--help` says what it takes); what they share is in `tools.common`."""
