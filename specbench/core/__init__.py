"""The pieces every part uses: errors, atomic files, the machine's fingerprint, the declared options,
the formulas, and where specbench finds its configs and cache."""
