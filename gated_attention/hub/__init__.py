"""Hub integration: the remote-code bundle, model cards, and telling a Hub id from a folder.

- `remote_code`: copies the modeling and config modules flat into a
  checkpoint (`modeling_attention.py`, ...), rewrites their relative imports,
  and sets `auto_map`, so that `trust_remote_code=True` loads without this
  package.
- `model_card`: renders the cards of converted checkpoints from the templates
  in `model_cards/` (reached through the link `hub/model_cards`).
- `repo_ids`: whether a model argument is a local folder or could be a Hub repo
  id, without the network.

Imports: nothing else of this package (it sits on the layer of
`configuration` and `kernels`, see docs/architecture.md); `modeling`,
`convert` and `analysis` use it.
"""
