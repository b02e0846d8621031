"""Performance benchmarks (not tests): each module measures the project against its nearest
real peer and writes a JSON result; BENCHMARKS.md has the figures and the commands. Run one
from the repository root with ``python -m bench.<module>`` (or ``albatross bench NAME``)."""
