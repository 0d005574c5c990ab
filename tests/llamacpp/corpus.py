# ruff: noqa: RUF001 - the corpus holds look-alike characters on purpose
"""The lane's texts: a multilingual tokenizer corpus (scripts, code, numbers, whitespace,
emoji), short prompts for greedy continuations, and one prompt past Gemma 3's 512-token
sliding window."""

from __future__ import annotations

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "Größenwahn und Übermut: Straße, Maß, Fußgänger.",
    "Où est la bibliothèque ? L'été dernier, nous étions à Besançon.",
    "机器学习是人工智能的一个分支。今天天气很好！",
    "東京タワーは高さ333メートルです。ひらがなとカタカナ。",
    "안녕하세요, 세계! 한국어 토크나이저 테스트입니다.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "مرحبا بالعالم، هذه جملة عربية للاختبار.",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "const xs = [1, 2, 3].map((x) => x ** 2); // => [1, 4, 9]\r\n",
    'fn main() { let v: Vec<u64> = (0..10).collect(); println!("{v:?}"); }',
    "3.14159265358979 × 10^-7, 1,234,567.89 and 007 — 2026-11-28T16:15:00Z",
    "    four spaces, two  spaces,\n\n\nthree newlines,\t\ttabs   and trailing   ",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖✨ and a decomposed e\u0301",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
]

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Die drei größten Städte Deutschlands sind",
    "1, 1, 2, 3, 5, 8, 13,",
]

# ~700 tokens: a plain-English story (not a repetition a model could copy from far back,
# so the tokens outside the window matter only through the global layers).
LONG_TEXT = (
    " ".join(
        f"Day {day}: the lighthouse keeper on the island of {place} wrote that the {thing} "
        f"had {event}, and that the supply boat from {port} arrived {when} carrying {cargo}."
        for day, (place, thing, event, port, when, cargo) in enumerate(
            [
                (
                    "Skerry",
                    "lamp",
                    "flickered twice before midnight",
                    "Oban",
                    "late",
                    "oil and flour",
                ),
                ("Inchkeith", "fog bell", "rung without wind", "Leith", "early", "coal"),
                (
                    "Bardsey",
                    "north window",
                    "cracked in the frost",
                    "Aberdaron",
                    "on time",
                    "glass",
                ),
                ("Fastnet", "clockwork", "stopped at four", "Crookhaven", "a day late", "springs"),
                ("Eddystone", "gallery rail", "rusted through", "Plymouth", "at dawn", "paint"),
                ("Longships", "cistern", "run dry", "Sennen", "after the storm", "water casks"),
                ("Flannan", "landing crane", "jammed", "Breasclete", "never", "nothing"),
                ("Muckle Flugga", "stove", "smoked all week", "Unst", "at noon", "peat"),
                ("Bass Rock", "gannets", "returned in thousands", "North Berwick", "early", "nets"),
                ("Skellig", "chapel roof", "lost three slates", "Portmagee", "by evening", "slate"),
                ("Tory", "foghorn", "sounded on its own", "Magheroarty", "late", "a mechanic"),
                (
                    "Sule Skerry",
                    "radio",
                    "caught a Norwegian station",
                    "Stromness",
                    "on time",
                    "tea",
                ),
                ("Hyskeir", "garden", "yielded potatoes", "Mallaig", "at dusk", "seed and lime"),
                ("Bishop Rock", "lens", "needed polishing", "St Mary's", "early", "cloths"),
                ("Rathlin", "west door", "blown open", "Ballycastle", "late", "hinges"),
                ("Ailsa Craig", "quarry", "fallen silent", "Girvan", "at noon", "letters"),
                ("Copeland", "signal flags", "faded", "Donaghadee", "a week late", "new flags"),
                ("Dubh Artach", "barometer", "fallen sharply", "Erraid", "after two days", "bread"),
                ("Start Point", "cliff path", "slipped", "Dartmouth", "on time", "rope"),
                ("Hook Head", "tower stairs", "worn smooth", "Waterford", "early", "a carpenter"),
            ],
            start=1,
        )
    )
    + " Reading the whole log again, the keeper's summary of the year was that"
)
