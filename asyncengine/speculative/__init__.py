"""Speculative decoding on the scheduler side (no torch): its settings, the prompt-lookup
(n-gram) proposer, the rule that says how many guesses a request gets, and the acceptance of a
verified row. The runner verifies the guesses (executor/runner.py ``verify_rows``)."""
