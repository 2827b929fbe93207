"""The one error type of the artifact contract."""


class ManifestError(ValueError):
    """A manifest (or an artifact against its manifest) breaks the contract.

    The message is one line naming the file, the key, the value found and what
    is allowed.
    """
