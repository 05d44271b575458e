"""Compare a prediction with the stored answer, and say only "right" or "not yet".

A wrong prediction gets no clue about which value is off: the values are checked together,
so a yes/no value cannot be read off the verdict."""
from __future__ import annotations

import json
import re
from pathlib import Path

ANSWERS = Path(__file__).resolve().parent / "answers.json"
SYNONYMS = {"true": "yes", "y": "yes", "false": "no", "n": "no", "same": "equal", "less": "fewer",
            "last_token": "last-token", "never_saved": "never-saved", "in_flight": "in-flight"}
ZH_SYNONYMS = {"是": "yes", "否": "no", "不": "no", "更少": "fewer", "少": "fewer", "相等": "equal",
               "相同": "equal", "一样": "equal", "更多": "more", "多": "more"}


def load_answers() -> dict[int, dict]:
    return {int(k): v for k, v in json.loads(ANSWERS.read_text()).items()}


def normalise(words: list[str]) -> list[str]:
    """'512, 256' / 'Yes' / 'same' / '是' -> ['512', '256'] / ['yes'] / ['equal'] / ['yes']:
    spaces, commas and semicolons (full-width ones and '、' too) separate values."""
    values = []
    for word in re.split(r"[\s,;，；、]+", " ".join(words)):
        word = word.strip().lower()
        if word:
            values.append(SYNONYMS.get(word, ZH_SYNONYMS.get(word, word)))
    return values


def check(number: int, prediction: list[str], asks: tuple[str, ...], lang: str = "en") -> tuple[bool, str]:
    """(right?, what to print). The message never contains the answer unless it is right.
    ``lang="zh"``: the message in Chinese (exercises/zh.py), ``asks`` its Chinese labels."""
    expected = load_answers()[number]
    values = normalise(prediction)
    if lang == "zh":
        from exercises.zh import MESSAGES, TEXTS
        if len(values) != len(asks):
            return False, MESSAGES["count"].format(number=number, n=len(asks), asks="；".join(asks),
                                                   got=len(values))
        if values == [str(v).lower() for v in expected["values"]]:
            return True, MESSAGES["right"].format(why=TEXTS[number]["WHY"])
        return False, MESSAGES["wrong"].format(number=number)
    if len(values) != len(asks):
        return False, (f"Exercise {number} takes {len(asks)} values, in this order: "
                       + "; ".join(asks) + f". Got {len(values)}.")
    if values == [str(v).lower() for v in expected["values"]]:
        return True, "Right. " + expected["why"]
    return False, ("Not yet. The values are checked together, so this says nothing about which "
                   "one is off. Think again, or run the experiment: "
                   f"python -m exercises {number} --run (it shows the answer).")
