"""Writes asyncengine_mc/asyncengine_mc.jsonl: a small multiple-choice task (world capitals,
arithmetic, opposites, what comes next) for lm-evaluation-harness, made here so that scoring a
model through the server needs no download. Deterministic: rerunning it rewrites the same file.

    .venv/bin/python scripts/lm_eval_tasks/make_asyncengine_mc.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Hungary": "Budapest",
    "Ireland": "Dublin",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Argentina": "Buenos Aires",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "India": "New Delhi",
    "Turkey": "Ankara",
    "Belgium": "Brussels",
    "the Netherlands": "Amsterdam",
    "Switzerland": "Bern",
    "Australia": "Canberra",
    "South Korea": "Seoul",
    "Cuba": "Havana",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Ukraine": "Kyiv",
    "Czechia": "Prague",
    "Romania": "Bucharest",
    "Colombia": "Bogota",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "open": "closed",
    "early": "late",
    "full": "empty",
    "young": "old",
    "strong": "weak",
    "rich": "poor",
    "wet": "dry",
    "hard": "soft",
    "high": "low",
    "long": "short",
    "loud": "quiet",
    "thick": "thin",
    "first": "last",
    "inside": "outside",
    "day": "night",
    "win": "lose",
    "push": "pull",
    "buy": "sell",
    "left": "right",
    "true": "false",
    "north": "south",
    "east": "west",
    "love": "hate",
    "black": "white",
}
SEQUENCES = [
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"],
]


def choices(
    rng: random.Random, answer: str, pool: list[str], count: int = 4
) -> tuple[list[str], int]:
    options = rng.sample([p for p in pool if p != answer], count - 1) + [answer]
    rng.shuffle(options)
    return options, options.index(answer)


def items() -> list[dict[str, object]]:
    rng = random.Random(29)
    out: list[dict[str, object]] = []
    capitals = list(CAPITALS.values())
    for country, capital in CAPITALS.items():
        options, answer = choices(rng, capital, capitals)
        out.append(
            {
                "question": f"Question: What is the capital of {country}?\nAnswer:",
                "choices": options,
                "answer": answer,
            }
        )
    for _ in range(40):
        a, b = rng.randrange(2, 20), rng.randrange(2, 20)
        right = a + b
        pool = [str(right + d) for d in (-3, -2, -1, 1, 2, 3, 10)]
        options, answer = choices(rng, str(right), pool + [str(right)])
        out.append(
            {
                "question": f"Question: What is {a} plus {b}?\nAnswer:",
                "choices": options,
                "answer": answer,
            }
        )
    words = list(OPPOSITES.values()) + list(OPPOSITES)
    for word, opposite in OPPOSITES.items():
        options, answer = choices(rng, opposite, [w for w in words if w != word])
        out.append({"question": f"The opposite of {word} is", "choices": options, "answer": answer})
    for sequence in SEQUENCES:
        for i in range(len(sequence) - 1):
            options, answer = choices(rng, sequence[i + 1], sequence)
            out.append(
                {
                    "question": f"What comes after {sequence[i]}? It is",
                    "choices": options,
                    "answer": answer,
                }
            )
    return out


def main() -> None:
    path = Path(__file__).with_name("asyncengine_mc") / "asyncengine_mc.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items()))
    print(f"{path}: {len(items())} questions")


if __name__ == "__main__":
    main()
