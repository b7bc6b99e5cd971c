"""`swiftlite export --to_ollama true`: a `Modelfile` next to the exported weights, so that
`ollama create NAME -f OUT/Modelfile` imports the folder as it is (ms-swift's `swift export --to_ollama`).

ms-swift writes its Modelfile from its own template table (prefix, system prefix, prompt, suffix);
swiftlite has no such table: the conversation format is the tokenizer's chat template (Jinja), which
ollama's legacy Go template cannot run. So the same four pieces are read off the chat template itself,
by rendering probe conversations with marker texts and cutting the result at the markers:

    [system S, user Q] + generation prompt  ->  a0 S a1 Q a2
    [user Q] + generation prompt            ->  b0 Q a2        (b0: the template's own default system, if any)
    [system S, user Q, assistant R]         ->  a0 S a1 Q a2 R suffix

The user turn's opening is the longest common end of a1 and b0; what comes before it is the system
turn's closing (a1) or the default system (b0). The Go template is then

    {{ if .System }}a0{{ .System }}<a1 less the opening>{{ else }}<b0 less the opening>{{ end }}
    {{ if .Prompt }}<opening>{{ .Prompt }}a2{{ end }}{{ .Response }}suffix

which renders one exchange exactly as the chat template does (tests/e2e/test_export_ollama.py renders
both and compares, with and without a system prompt). A template whose answer opening differs from its
generation prompt (a thinking block added to past answers) or that changes the probe texts cannot be
expressed this way and is refused with that reason. Sampling settings come from the folder's
generation_config.json (the ones present), stop words from the suffix and the eos tokens, as ms-swift's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swiftlite.data.templates import template_pieces
from swiftlite.errors import UserError

MODELFILE = "Modelfile"
#: generation_config.json key -> Modelfile PARAMETER name.
PARAMETERS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
              "repetition_penalty": "repeat_penalty"}


def modelfile(tokenizer: Any, generation_config: dict, source: str, where: str) -> str:
    """The Modelfile's text: FROM `source`, the TEMPLATE, stop words and sampling parameters."""
    try:
        p = template_pieces(tokenizer, where)
    except UserError as e:
        raise UserError(f"{e}: an ollama TEMPLATE is made of those pieces; write the Modelfile by hand") from None
    for k, v in p.items():
        if '"""' in v:
            raise UserError(f"{where}: the chat template's {k} holds triple quotes, which a Modelfile TEMPLATE cannot")
    template = (f"{{{{ if .System }}}}{p['system_prefix']}{{{{ .System }}}}{p['system_suffix']}{{{{ else }}}}"
                f"{p['prefix']}{{{{ end }}}}{{{{ if .Prompt }}}}{p['opening']}{{{{ .Prompt }}}}{p['generation']}"
                f"{{{{ end }}}}{{{{ .Response }}}}{p['suffix']}")
    lines = [f"FROM {source}", f'TEMPLATE """{template}"""']
    stops: list[str] = []
    eos = generation_config.get("eos_token_id", getattr(tokenizer, "eos_token_id", None))
    for tid in (eos if isinstance(eos, list) else [eos]):
        if isinstance(tid, int):
            stops.append(tokenizer.convert_ids_to_tokens(tid))
    for word in [p["suffix"].strip(), *stops]:
        if word and f'PARAMETER stop "{word}"' not in lines:
            lines.append(f'PARAMETER stop "{word}"')
    for key, name in PARAMETERS.items():
        if generation_config.get(key) is not None:
            lines.append(f"PARAMETER {name} {generation_config[key]}")
    return "\n".join(lines) + "\n"


def write_modelfile(folder: Path, tokenizer_dir: Path, source: str, where: str, log: Any, final: Path) -> Path:
    """Write `folder`/Modelfile for the model whose tokenizer and generation_config.json are in
    `tokenizer_dir`; FROM `source` (`.`: the folder itself, or the model folder used as it is);
    `final`: where `folder` is published (for the message)."""
    import json

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    gen_file = tokenizer_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    path = folder / MODELFILE
    path.write_text(modelfile(tok, gen, source, where))
    log(f"wrote {path.name}: `ollama create NAME -f {final / MODELFILE}` imports it")
    return path
