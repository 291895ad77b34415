"""What `transfer` and `shard` share about a DEST: one writer at a time (lease), which files a run owns and
may remove (ownership), overlap of SOURCE and DEST (overlap), the manifests and their one completeness rule
(manifests), `--worker K/N` shares (shares), and part sizing, the byte budget and unfinished uploads (uploads)."""
