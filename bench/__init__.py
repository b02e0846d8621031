"""Performance benchmarks (not tests): each module measures the project against its nearest
real peer and writes a JSON result; docs/benchmarks.md is generated from the committed ones. Run
one from the repository root with ``python -m bench.<module>`` (or ``albatross bench NAME``)."""
