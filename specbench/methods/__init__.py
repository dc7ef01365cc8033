"""Decoding methods: the Method base, the methods of specbench's loop (the registry), and the
serving engines' methods."""
