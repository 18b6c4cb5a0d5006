"""Hub integration and the folders a checkpoint lives in.

- `remote_code`: the remote-code bundle written beside a checkpoint's weights.
- `model_card`: model-card rendering.
- `repo_ids`: whether a name is a local folder or can be a Hub repo id (no network).
- `output_folders`: which output folders a command may write or replace (`check_output_folder`).
"""
