"""The drafters of specbench's loop: what proposes the tokens a round verifies.

A drafter (decoding.decode.Drafter) starts on a prompt, proposes a chain or a tree of tokens with the rows
they were drawn from (its q), and hears the verdict. One module each: a small model
sampling a chain (model.py), prompt lookup and lookup-or-model (lookup.py), a cascade of levels each
verified by the one above (cascade.py), trees of either kind (trees.py), and an EAGLE head's chains and
trees (eagle.py, with the head of models/eagle_head.py). A draft model and an EAGLE head draw their
chains and trees the same way (propose.py).
"""
