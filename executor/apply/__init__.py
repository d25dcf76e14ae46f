"""The appliers: one function per parallelism, applied in one fixed order (`materialize`),
and what they need of the model (its layer map, tied weights, TP styles) and of the plan
(the refusal before launch, `validate`)."""
