"""A small strict parser for the DOT language subset graph tools accept: digraph, subgraphs,
graph/node/edge defaults, node and edge statements with attribute lists. It raises on anything
malformed, so tests can check that explain()'s DOT text is valid without Graphviz installed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOKEN = re.compile(
    r'\s*(?:(->)|([{}\[\];,=])|"((?:[^"\\]|\\.)*)"|([A-Za-z_][\w.]*|-?\d+(?:\.\d+)?))', re.S
)


@dataclass
class DotGraph:
    name: str
    nodes: dict[str, dict] = field(default_factory=dict)
    edges: list[tuple[str, str, dict]] = field(default_factory=list)
    clusters: list[str] = field(default_factory=list)


def tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise ValueError(f"bad DOT text at {text[pos : pos + 30]!r}")
        arrow, punct, quoted, bare = match.groups()
        if arrow:
            tokens.append(("->", "->"))
        elif punct:
            tokens.append((punct, punct))
        elif quoted is not None:
            tokens.append(("id", quoted.replace('\\"', '"')))
        else:
            tokens.append(("id", bare))
        pos = match.end()
    return tokens


class Parser:
    def __init__(self, text: str):
        self.tokens = tokenize(text)
        self.pos = 0

    def peek(self, offset: int = 0) -> str | None:
        at = self.pos + offset
        return self.tokens[at][0] if at < len(self.tokens) else None

    def take(self, kind: str) -> str:
        if self.peek() != kind:
            raise ValueError(f"expected {kind!r} at token {self.pos}, got {self.peek()!r}")
        self.pos += 1
        return self.tokens[self.pos - 1][1]

    def parse(self) -> DotGraph:
        if self.take("id") != "digraph":
            raise ValueError("not a digraph")
        graph = DotGraph(self.take("id") if self.peek() == "id" else "")
        self.block(graph)
        if self.pos != len(self.tokens):
            raise ValueError("text after the closing brace")
        return graph

    def block(self, graph: DotGraph) -> None:
        self.take("{")
        while self.peek() != "}":
            self.statement(graph)
            if self.peek() == ";":
                self.take(";")
        self.take("}")

    def statement(self, graph: DotGraph) -> None:
        word = self.take("id")
        if word in ("graph", "node", "edge") and self.peek() == "[":
            self.attributes()
        elif word == "subgraph":
            graph.clusters.append(self.take("id") if self.peek() == "id" else "")
            self.block(graph)
        elif self.peek() == "=":
            self.take("=")
            self.take("id")
        elif self.peek() == "->":
            chain = [word]
            while self.peek() == "->":
                self.take("->")
                chain.append(self.take("id"))
            attrs = self.attributes() if self.peek() == "[" else {}
            graph.edges += [(a, b, attrs) for a, b in zip(chain, chain[1:], strict=False)]
        else:
            attrs = self.attributes() if self.peek() == "[" else {}
            graph.nodes.setdefault(word, {}).update(attrs)

    def attributes(self) -> dict:
        attrs = {}
        self.take("[")
        while self.peek() != "]":
            key = self.take("id")
            self.take("=")
            attrs[key] = self.take("id")
            if self.peek() in (",", ";"):
                self.pos += 1
        self.take("]")
        return attrs


def label_text(raw: str) -> str:
    """A label's text as Graphviz draws it: \\n (and \\l, \\r) end lines, \\\\ is a backslash."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) in "nlr" else m.group(1), raw)


def parse_dot(text: str) -> DotGraph:
    return Parser(text).parse()
