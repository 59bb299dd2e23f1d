// Shared by every decoder kernel (npu-hal's Vulkan backend): the step buffer at binding 0, which
// the host writes before each submission of a recorded program. Its words:
//   0 tokens in the batch (n)         1 position of the first token
//   2 first selected row              3 selected rows (Rows::Selected ops)
//   4 first spliced row               5 end of the spliced rows (Batch::embeddings)
//   6 offset of the token ids         7 offset of the KV slots (block * block_tokens + offset)
//   8 offset of the sequence's block table
//   9 where the spliced rows start in their buffer (f32 values; an imported unified buffer
//     is read from there, the upload buffer from 0)
//  10 the cache index of the batch's first token: its position less the tokens KV pruning
//     dropped before it (equal to word 1 when nothing was pruned)
//  11 the attention statistics' keys per layer and kind (programs that keep them)
// Everything else a kernel needs is fixed per op and recorded as immediates (push constants).
@group(0) @binding(0) var<storage, read> step: array<u32>;

fn step_n() -> u32 { return step[0u]; }
fn step_first_pos() -> u32 { return step[1u]; }
fn step_first_cached() -> u32 { return step[10u]; }
fn step_token(row: u32) -> u32 { return step[step[6u] + row]; }
fn step_slot(row: u32) -> u32 { return step[step[7u] + row]; }
fn step_block(logical: u32) -> u32 { return step[step[8u] + logical]; }

// The rows a linear op reads, as (first row, rows): every row, or the selected ones.
fn step_linear_rows(selected: u32) -> vec2<u32> {
    return select(vec2<u32>(0u, step[0u]), vec2<u32>(step[2u], step[3u]), selected != 0u);
}
