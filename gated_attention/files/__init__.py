"""Local files and data: what the commands read (`--dataset`, JSON lines) and the folders they write.

- `datasets`: `open_text_dataset`, what every `--dataset` flag opens (txt,
  jsonl, parquet or csv files, a `save_to_disk` folder, a cached Hub dataset)
  as a stream, with `DataError` as one line.
- `json_lines`: `JsonLinesCorpus`, JSON-lines files read a line at a time
  without `datasets`, a line longer than 1 MB scanned in blocks and its text
  decoded in parts, so a document of any length costs bounded memory;
  `open_corpus`, what the training streams and `analyze --dataset` read (local
  JSON-lines files, given or in a folder, through it; the rest through `datasets`).
- `output_folders`: which output folders a command may write or replace
  (`check_output_folder`): never the working folder, an input, or a folder
  that is not the package's own. Standard library only, so the commands check
  before importing torch.
- `staging`: output folders that appear whole or not at all (`staged_folder`: written beside the
  output, renamed into place; renameat2 without replacing; what killed runs leave behind; runs that
  write the same output, or one inside or around another's, refused while the other runs). Standard
  library only.

Imports: `cli_common`, and `hub` for a Hub dataset id (`hub.repo_ids.cached_or_downloaded`, the one
policy for fetching an id). It sits above `hub` and below `modeling` (see docs/architecture.md);
`training`, `analysis` and `convert` use it.
"""
