"""Chapter 1, collectives.

- ``checks``: the your-turn checks (broadcast from two halves, a direct all-reduce);
- ``bench``: ``python -m labsupport.bench collectives``, busbw of every collective.

This package re-exports the lesson; this chapter has none in the package.
"""
