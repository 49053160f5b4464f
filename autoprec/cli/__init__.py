"""The ``autoprec`` command line: one thin typer wrapper per library call."""

#: The arguments of the running command (``tune --workers`` re-launches them in children).
current_argv: list[str] = []
