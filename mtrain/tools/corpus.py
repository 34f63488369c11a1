"""A generated retrieval corpus: facts about fictional towns that no model can know, and questions on them.

Deterministic in `seed`, so a run, its held-out questions and its tests agree without shipping a file. One
document per town: "Quelmar is a town in the province of Drasken. Quelmar has a population of 48213. Quelmar
was founded in 1731. The main export of Quelmar is copper." Questions ask one attribute of one town; the answer
is exactly one document's fact, reachable by a BM25 query on the town's name.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t",
           "tr", "v", "z", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "n", "r", "l", "m", "s", "th", "x", "nd", "rk"]
_EXPORTS = ["copper", "wool", "salt", "timber", "glass", "cheese", "silk", "tin", "amber", "rice", "paper", "wine"]
ATTRIBUTES = ("province", "population", "founded", "export")


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    town: str
    attribute: str


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).capitalize()


def town_corpus(n_towns: int = 200, seed: int = 0) -> tuple[list[str], list[Question]]:
    """(documents, questions): one document and four questions (one per attribute) per town."""
    rng = random.Random(seed)
    provinces = sorted({_name(rng, 2) for _ in range(12)})
    towns: list[str] = []
    seen: set[str] = set()
    while len(towns) < n_towns:
        name = _name(rng, rng.choice((2, 3)))
        if name not in seen:
            seen.add(name)
            towns.append(name)
    docs, questions = [], []
    for town in towns:
        facts = {"province": rng.choice(provinces), "population": str(rng.randint(1_000, 99_999)),
                 "founded": str(rng.randint(1100, 1950)), "export": rng.choice(_EXPORTS)}
        docs.append(f"{town} is a town in the province of {facts['province']}. {town} has a population of "
                    f"{facts['population']}. {town} was founded in {facts['founded']}. The main export of {town} is "
                    f"{facts['export']}.")
        questions += [
            Question(f"In which province is the town of {town}?", facts["province"], town, "province"),
            Question(f"What is the population of {town}?", facts["population"], town, "population"),
            Question(f"In which year was {town} founded?", facts["founded"], town, "founded"),
            Question(f"What is the main export of {town}?", facts["export"], town, "export"),
        ]
    return docs, questions
