"""Exit statuses of `pagedgen run` (shown by `pagedgen run --help` and in docs/cli.md)."""

EXIT_OK = 0           # every request answered
EXIT_SOME_FAILED = 1  # the run completed; some lines failed (see the errors file)
EXIT_USAGE = 2        # usage, config, path or model problem found before generating
EXIT_INTERNAL = 3     # internal error: the whole run failed; the log path is printed
EXIT_WRITE_FAILED = 4  # a file could not be written (disk full, quota, I/O error): the file,
                       # the errno, how many answers are safe and the resume command are printed
# Interrupted: 128 + the signal's number (130 SIGINT / Ctrl-C, 143 SIGTERM); --resume continues.

EXIT_CODES_HELP = (
    "Exit status: 0 every request answered; 1 some lines failed (see the errors file); "
    "2 usage, config, path or model problem found before generating; 3 internal error "
    "(the traceback's log file is printed); 4 a file could not be written (disk full, I/O "
    "error: what is saved and the resume command are printed); 130 / 143 interrupted by SIGINT / SIGTERM "
    "(resume with --resume).")
