"""The exit codes of every command, in one place (README, "Command line")."""

EXIT_OK = 0      # the checkpoint is good, or the command did what it was asked
EXIT_BAD = 1     # a verdict: corrupt, invalid, incomplete, or nothing good was found
EXIT_ERROR = 2   # usage or infrastructure: the command could not give a verdict
