"""Seeded filler text whose length in tokens is known in advance, for synthetic prompts.

The words are common English words that byte-level BPE tokenizers of English-trained models
encode as one token each after a space (every one of them is a single token in the demo model's
tokenizer), so `words(rng, n)` is about `n` tokens. The load generator has no tokenizer of its
own; the server's `usage.prompt_tokens` gives the exact counts of what was sent.
"""

from __future__ import annotations

import math
import random

_WORD_LIST = """
    the of and to in is it you that he was for on are with as his they be at one have this
    from or had by word but what some we can out other were all there when up use your how
    said an each she which do their time if will way about many then them write would like
    so these her long make thing see him two has look more day could go come did number
    sound no most people my over know water than call first who may down side been now
    find any new work part take get place made live where after back little only round man
    year came show every good me give our under name very through just form great think
    say help low line turn cause much mean before move right boy old too same tell does
    set three want air well also play small end put home read hand port large add even
    land here must big high such follow act why ask men change went light kind off need
    house try us again point mother world near build self earth father head stand own page
    should country found answer grow still learn cover food sun four between state keep
    eye never last let thought city tree cross hard start might story saw far sea draw
    left late run while close night real life few open seem together next white children
    begin got walk example ease paper group always music those both mark letter until car
    feet care second book carry took eat room friend stop once base hear horse cut sure
    watch color face wood main enough plain young ready above ever red list though feel
    talk soon body dog family direct leave song measure door black short class wind
    question complete ship half order fire piece told knew pass since top whole king space
    heard best hour better true during hundred five remember step early hold ground reach
    fast verb sing six table less ten simple toward war lay against pattern slow love
    person money serve map rule cold voice power town fine certain fly fall lead cry dark
    note wait star field rest correct able done stood contain teach week final gave green
    quick free minute strong special mind clear tail produce fact nothing course stay full
    force object deep moon foot system test record common gold possible dry wonder laugh
    check shape hot brought heat bring fill language among
"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


def words(rng: random.Random, num_words: int) -> str:
    """`num_words` words drawn uniformly (with replacement), separated by single spaces."""
    if num_words < 0:
        raise ValueError(f"num_words must be >= 0, got {num_words}")
    return " ".join(rng.choices(WORDS, k=num_words))


def distinct_texts(rng: random.Random, count: int, num_words: int) -> list[str]:
    """`count` texts of `num_words` words each, no two alike.

    Up to `len(WORDS)` texts differ from their first word on, so two prompts that share what
    precedes these texts share no token beyond it; more texts are drawn again on a repeat.
    """
    if count > 1 and num_words * math.log(len(WORDS)) < math.log(count):
        raise ValueError(f"{count} distinct texts need more than {num_words} words each")
    if num_words == 0:
        return [""] * count
    if count <= len(WORDS):
        firsts = rng.sample(WORDS, count)
        return [" ".join([w, *rng.choices(WORDS, k=num_words - 1)]) for w in firsts]
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < count:
        text = words(rng, num_words)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
