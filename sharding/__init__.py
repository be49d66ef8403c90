"""Meshes, the logical-to-mesh axis table, and expert parallelism for gpt-oss."""
