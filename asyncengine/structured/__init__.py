"""Structured output: grammars compiled with xgrammar, one matcher per constrained request."""

from asyncengine.structured.grammar import GrammarCompiler, GrammarMatcher

__all__ = ["GrammarCompiler", "GrammarMatcher"]
