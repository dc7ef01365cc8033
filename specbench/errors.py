class SpecbenchError(Exception):
    """Bad input or environment: the message is one line naming the problem and the fix."""
