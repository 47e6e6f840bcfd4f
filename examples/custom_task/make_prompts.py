"""Write ``prompts.jsonl`` for the worked example: ``a X Y >`` asks for ``X + Y``.

Run: ``python make_prompts.py`` (the file is committed; this says how it was made).

The built-in tiny model reads space-separated words of its vocabulary only (``0`` to
``255``, ``a`` to ``z``, ``>``, ``=``, ...; a prompt file with any other word is refused
before the run, naming the line and the vocabulary): the numbers stay below 128 so that
every sum is one word too.
"""

import json
import random


def main() -> None:
    rng = random.Random(0)
    with open("prompts.jsonl", "w") as f:
        for _ in range(512):
            x, y = rng.randrange(128), rng.randrange(128)
            f.write(json.dumps({"prompt": f"a {x} {y} >", "answer": str(x + y)}) + "\n")


if __name__ == "__main__":
    main()
