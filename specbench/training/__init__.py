"""Training drafters: distillation, its data and teachers, EAGLE heads, held-out questions, and
the online learner."""
