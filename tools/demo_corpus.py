"""Corpus for the demo model: passages of the Python language reference.

The text comes from ``pydoc_data.topics``, the help topics that ship with
CPython (Python Software Foundation License). Nothing is downloaded. The
exact text depends on the Python version that runs the script, which is
why the demo prompts are stored as token ids next to the checkpoint.
"""

from pydoc_data.topics import topics as _TOPICS

# Topic whose opening paragraphs every demo prompt starts with.
PREFIX_TOPIC = "execmodel"
PREFIX_MAX_CHARS = 1900

# Short topics whose beginnings follow the shared prefix in the demo prompts.
# Each has a distinctive title, so a few tokens identify the passage.
PROMPT_TOPICS = (
    "pass", "break", "continue", "if", "while", "for", "return", "del",
    "lambda", "assert", "global", "nonlocal", "yield", "truth",
)
# Longer passages are cut at a paragraph boundary: the demo only needs the
# start of each passage, and shorter sequences train faster.
PASSAGE_MAX_CHARS = 1100

# Further topics trained on their own, so the model has seen more text.
EXTRA_TOPICS = (
    "numbers", "typesfunctions", "lists", "conversions", "dynamic-features",
    "bitwise", "unary", "attribute-references", "floating", "booleans",
    "await", "callable-types", "bltin-null-object", "bltin-ellipsis-object",
    "imaginary", "shifting", "power", "integers",
)


def topic_text(name):
    """Return one help topic with trailing spaces removed from each line."""
    lines = [line.rstrip() for line in _TOPICS[name].splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def head_paragraphs(text, max_chars):
    """Return the leading whole paragraphs of text, at most max_chars long.

    Cutting at a blank line keeps every passage a readable unit.
    """
    paragraphs = text.split("\n\n")
    kept = [paragraphs[0]]
    for para in paragraphs[1:]:
        candidate = "\n\n".join(kept + [para])
        if len(candidate) > max_chars:
            break
        kept.append(para)
    return "\n\n".join(kept).rstrip("\n") + "\n"


def shared_prefix():
    """Return the common prefix of all demo prompts, ending in a blank line."""
    return head_paragraphs(topic_text(PREFIX_TOPIC), PREFIX_MAX_CHARS) + "\n"


def passage(name):
    """Return the passage of one topic used after the shared prefix."""
    return head_paragraphs(topic_text(name), PASSAGE_MAX_CHARS)


def tokenizer_texts():
    """Return every help topic, sorted by name, for training the tokenizer."""
    return [topic_text(name) for name in sorted(_TOPICS)]


def training_topics():
    """Return the names of all topics the model is trained on, in order."""
    return (PREFIX_TOPIC,) + PROMPT_TOPICS + EXTRA_TOPICS
