"""Speculative decoding (issue 53), built in pieces. Proposers suggest the next few
tokens of a sequence cheaply; the engine's target model checks them in one step.
So far: ``ngram`` (prompt lookup, no model). Plain code, no torch."""
