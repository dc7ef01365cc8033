"""specbench audit: the audit, its verdicts, two-sample statistics, and the known-broken subjects."""
