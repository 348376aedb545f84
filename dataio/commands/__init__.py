"""One module per ``dataio`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
