"""The supervisor: the command line, the shared listening socket, the process group and its watchdog."""
