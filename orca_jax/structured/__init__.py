"""Structured outputs: the constraint a request asks for (json, regex, choice, grammar) and the
llguidance matchers that turn it into each step's token bitmask. A capability beside the core
layer: sampling params hold a constraint and the scheduler and sampler read its mask."""
