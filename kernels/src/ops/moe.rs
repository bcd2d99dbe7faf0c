//! Mixture-of-experts routing and token dispatch (Hugging Face `MixtralSparseMoeBlock`), each with its backward.
//!
//! Legend: `L` tokens, `C` channels, `E` experts, `K` experts per token (top-k), `N = L·K` dispatched rows.
//!
//! ```text
//! router_forward    p[L,E] = softmax(logits) (f32)      experts[L,K] = top-k of p (ties: lower index first)
//!                   w[L,K] = p[experts] / Σ_k p[experts]  (HF Mixtral: softmax over all E, top-k, renormalise)
//!                   also per expert: tokens routed (counts) and Σ_t p[t,e] (the load-balancing loss' inputs)
//! router_backward   dp[t,e] = aux[e] (the auxiliary loss's gradient, the same for every token)
//!                   dp[t,experts[t,j]] += (dw[t,j] − Σ_m dw[t,m]·w[t,m]) / Σ_m p[t,experts[t,m]]
//!                   dlogits[t,e] = p[t,e]·(dp[t,e] − Σ_e' p[t,e']·dp[t,e'])
//! gather            xe[n,:] = x[rows[n],:]                 (rows expert-major: expert 0's tokens, then 1's, …)
//! gather_backward   dx[t,:] = Σ_{n : rows[n]=t} dxe[n,:]
//! combine           out[t,:] = Σ_{n : rows[n]=t} w[slot[n]]·ye[n,:]
//! combine_backward  dye[n,:] = w[slot[n]]·dout[rows[n],:]   dw[slot[n]] = ⟨dout[rows[n],:], ye[n,:]⟩
//! ```
//!
//! No capacity: every token reaches its `K` experts, and expert `e`'s tokens are the contiguous rows
//! `offsets[e]..offsets[e+1]` of the dispatched buffer, in token order, so each expert is one plain matrix
//! product. Every sum over a token's experts runs in ascending expert order (HF's loop over experts adding
//! into zeros), one token per task: results are bit-identical for any thread count and do not depend on which
//! other tokens share the call (a context-parallel rank's share of the sequence routes as the whole would).

use crate::checks::{nonzero, numel};
use crate::error::{check_len, KernelError, Result};

/// Where each token goes: the router's top-k experts and the dispatch order that groups tokens by expert. Host
/// metadata (a few integers per token), made by [`Backend::moe_router_forward`](crate::Backend::moe_router_forward).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    pub(crate) tokens: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    /// `[L·K]`: token `t`'s `j`-th choice (by probability, highest first).
    pub(crate) choice: Vec<u32>,
    /// `[E + 1]`: expert `e`'s rows are `offsets[e]..offsets[e+1]`.
    pub(crate) offsets: Vec<usize>,
    /// `[N]`: the token of each dispatched row.
    pub(crate) rows: Vec<u32>,
    /// `[N]`: the `t·K + j` slot of each dispatched row (its routing weight).
    pub(crate) slots: Vec<u32>,
    /// `[L·K]`: token `t`'s dispatched rows, ascending (so by ascending expert).
    pub(crate) inv: Vec<u32>,
}

impl Routing {
    /// The routing of top-k choices `choice[L·K]` over `experts` experts.
    ///
    /// Errors: zero sizes, a length that is not `tokens·top_k`, a choice `>= experts`, or a token choosing an
    /// expert twice.
    pub fn new(choice: Vec<u32>, tokens: usize, experts: usize, top_k: usize) -> Result<Routing> {
        nonzero("tokens", tokens)?;
        nonzero("experts", experts)?;
        nonzero("top_k", top_k)?;
        if top_k > experts {
            return Err(KernelError::InvalidArgument {
                name: "top_k",
                why: format!("{top_k} is more than the {experts} experts"),
            });
        }
        check_len("choice", choice.len(), numel("choice", &[tokens, top_k])?)?;
        for (t, c) in choice.chunks_exact(top_k).enumerate() {
            for (j, &e) in c.iter().enumerate() {
                if e as usize >= experts || c[..j].contains(&e) {
                    return Err(KernelError::InvalidArgument {
                        name: "choice",
                        why: format!("token {t}'s choices {c:?}: each must be a distinct expert below {experts}"),
                    });
                }
            }
        }
        let mut offsets = vec![0usize; experts + 1];
        for &e in &choice {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let n = choice.len();
        let (mut fill, mut rows, mut slots, mut inv) = (offsets.clone(), vec![0u32; n], vec![0u32; n], vec![0u32; n]);
        for (slot, &e) in choice.iter().enumerate() {
            let row = fill[e as usize];
            fill[e as usize] += 1;
            rows[row] = (slot / top_k) as u32;
            slots[row] = slot as u32;
            inv[slot] = row as u32;
        }
        for t in inv.chunks_exact_mut(top_k) {
            t.sort_unstable();
        }
        Ok(Routing { tokens, experts, top_k, choice, offsets, rows, slots, inv })
    }
    /// Tokens `L`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Experts `E`.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Experts per token `K`.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Dispatched rows `N = L·K`.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }
    /// `[L·K]`: each token's choices, highest probability first.
    pub fn choice(&self) -> &[u32] {
        &self.choice
    }
    /// Expert `e`'s dispatched rows: `offsets()[e]..offsets()[e+1]`.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
    /// Tokens routed to each expert.
    pub fn counts(&self) -> Vec<u64> {
        self.offsets.windows(2).map(|w| (w[1] - w[0]) as u64).collect()
    }
    /// The token of each dispatched row.
    pub fn row_tokens(&self) -> &[u32] {
        &self.rows
    }
    /// Bytes of host memory the routing holds.
    pub fn bytes(&self) -> usize {
        Self::bytes_for(self.tokens, self.experts, self.top_k)
    }
    /// Bytes a routing of `tokens` over `experts` with `top_k` holds.
    pub fn bytes_for(tokens: usize, experts: usize, top_k: usize) -> usize {
        4 * tokens * top_k * 4 + (experts + 1) * std::mem::size_of::<usize>()
    }
}

/// What [`Backend::moe_router_forward`](crate::Backend::moe_router_forward) returns beside its outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterOutput {
    /// The dispatch of the tokens.
    pub routing: Routing,
    /// `[E]`: `Σ_t p[t,e]` over this call's tokens, in `f64` (with the counts, the load-balancing loss' inputs).
    pub prob_sum: Vec<f64>,
}
