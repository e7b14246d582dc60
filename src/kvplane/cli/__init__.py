"""The ``kvplane`` command line: one thin module per subcommand group, no business logic."""
