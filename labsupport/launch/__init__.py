"""Everything that starts, runs and stops ranks (the public face is ``labsupport``).

See ``labsupport/README.md`` for each module's role and the round trip of
``cluster.run(fn)``. This file imports nothing, so a module of the package
may import a sibling without loading the rest.
"""
