"""Models: loading them, the LM wrapper the loop speaks to, specbench's fast forward, the EAGLE
head's layer, the loaded pair, and forward costs."""
