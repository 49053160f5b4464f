"""What crosses the boundary with the user, below every stage: files read without hanging
and written atomically (``fileio``), file and module paths (``paths``: output and storage
paths checked, wrapper prefixes of module paths normalised), argument checks that run before
any work (``validate``) and optional dependencies with their install hint (``extras``).

Each raises an ``autoprec.errors`` subclass naming the file, flag or value. Import the
modules themselves (``autoprec.io.fileio``); this package re-exports nothing.
"""
