"""Test doubles for ckptstore's own tests and benchmarks. Not public API: no compatibility is
promised, and production code never imports it."""
