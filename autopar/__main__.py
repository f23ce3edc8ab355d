"""``python -m autopar``: the ``autopar`` command, for an interpreter whose scripts folder is
not on the PATH (:func:`autopar.cli.entry`)."""

from autopar.cli import entry

if __name__ == "__main__":
    entry()
