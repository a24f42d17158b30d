"""Grammars a client can send that crash llguidance's compiler (a stack overflow: it recurses along chains of
$refs and rules) or keep it busy for seconds (the GBNF converter's time grows faster than the square of the rules),
measured with llguidance 1.9: what an API server must survive (apiserver/grammar_checker.py)."""


def ref_chain(depth: int) -> dict:
    """A JSON schema whose `$ref`s chain `depth` deep: 1,000 (105 KB) overflowed an 8 MB stack, 100 takes a few
    hundred KB. No property is required, so `{}` is valid."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(depth: int) -> str:
    """A Lark grammar whose rules chain `depth` deep: 3,200 overflowed an 8 MB stack."""
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(depth))
    return f'start: r0\n{rules}\nr{depth}: "z"\n'


def gbnf_chains(chains: int, rules: int) -> str:
    """`chains` GBNF chains of `rules` rules each, the root any one of them: the converter's time grows with their
    number, faster than linearly (4 of 600 took 0.6 s, 64 13.6 s), each short of the depth whose compilation
    overflows a checker's stack (1,000)."""
    lines = [f'c{c}r{i} ::= "a" c{c}r{i + 1} | "b"' for c in range(chains) for i in range(rules)]
    ends = [f'c{c}r{rules} ::= "z{c}"' for c in range(chains)]
    root = " | ".join(f"c{c}r0" for c in range(chains))
    return f"root ::= {root}\n" + "\n".join(lines + ends) + "\n"


def slow_gbnf(tag: str = "") -> str:
    """A grammar that keeps a checker busy past any --structured-output-check-timeout the tests set (6 s at most)
    on any CPU: 13.6 s of conversion on a 2-core AMD EPYC VM, 1.3 MB. `tag`, a comment, makes it another client's
    (not the same check)."""
    return gbnf_chains(64, 600) + (f"# {tag}\n" if tag else "")
