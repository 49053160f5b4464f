"""autoprec's version, in a module of its own: what records it (a policy's provenance, the
probe cache's key, ``autoprec env``) imports it from here, not the package root."""

__version__ = "0.1.0"
