class SpecbenchError(Exception):
    """Bad input or environment: the message is one line naming the problem and the fix."""


def first_said(e: BaseException) -> str:
    """The first line of what ``e`` says (its type's name where it says nothing): a library's error in
    one of ours, its pages of detail left out."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def first_line(e: BaseException) -> str:
    """The line of an exception that says what went wrong, after its type's name (pydantic's first line
    only counts errors: its first "Value error" line is taken)."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    said = next((line.removeprefix("Value error, ") for line in lines if line.startswith("Value error")), None)
    said = said or (lines[0] if lines else "")
    return f"{type(e).__name__}: {said.split(' [type=')[0]}" if said else type(e).__name__


def out_of_memory(said: str) -> SpecbenchError:
    """A device's out-of-memory error (``said``: torch's message) as one line: what torch said of the
    allocation, and the options under which a run holds less."""
    said = ". ".join(said.split(". ")[:3]).strip().rstrip(".")
    return SpecbenchError(
        f"out of memory ({said}): hold less with --dtype bfloat16 or float16, a smaller --max-new-tokens or "
        "--prefill-chunk, --device-map auto (the target spread over the GPUs), a smaller --k or fewer --method; "
        "rows measured so far are in the run directory"
    )
