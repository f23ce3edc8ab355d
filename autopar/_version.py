"""The autopar version (one place; a leaf module so plan files and fingerprints can name it)."""

__version__ = "0.1.0"


def major_minor(version: str = __version__) -> str:
    """``"0.1"`` for ``"0.1.0"``: plans and fingerprints are compatible within a minor version."""
    return ".".join(version.split(".")[:2])
