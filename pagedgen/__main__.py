"""`python -m pagedgen ...`: the same command line as the `pagedgen` script."""

from pagedgen.cli.app import app

if __name__ == "__main__":
    app(prog_name="pagedgen")
