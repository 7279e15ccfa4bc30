"""Measurement helpers and benchmark scripts (``python -m labsupport.bench``)."""
