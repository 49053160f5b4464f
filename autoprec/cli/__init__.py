"""The ``autoprec`` command line: one thin typer wrapper per library call."""
