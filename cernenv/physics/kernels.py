"""Compiled inner loops of the physics (numba): the bump scan's Fisher scoring
(``profile_rows``), the fits' cost with its exact gradient and Hessian (``deviance``), the
fits' Newton direction (``newton_direction``) and, for fits whose signal is a Gaussian of
width 0 or absent, their whole Newton minimisation (``newton_minimise``).

Written with numpy, these loops touch arrays of a few hundred numbers a few dozen times per
fit or mass hypothesis, and each operation costs more in the interpreter than in arithmetic.
The same algorithms in plain loops, compiled by numba, are what runs; their numpy or Python
descriptions are the docstrings of ``scan._profile``, ``likelihood.PoissonDeviance`` and
``fitting._newton``, and tests/test_kernels.py holds each kernel to independent code. Their
products and small factorisations are ``portable``'s loops (a fixed order, no BLAS or LAPACK), so
they make the same bits on every processor.

Compiling them takes about 20 s on a 2-core machine, once per machine and source version:
numba caches the result (``__pycache__`` beside this file, else the user's cache folder), and
``scan.warm_up`` compiles ahead (``make setup`` and the server at start call it). Every
function takes plain arrays and numbers (no objects).
"""

from __future__ import annotations

import numpy as np

from .portable import _solve_columns, eigh, matmul, matvec, njit, svd, vecdot

WALL_GAP = 1e-9
"""A log-log slope this close to its floor is on the wall (``scan._profile``)."""
CONVERGED_DECREMENT = 1e-7
"""Newton decrement (twice the predicted NLL decrease) below which a row has converged."""
NLL_RISE_TOLERANCE = 1e-12
"""Relative rise of the NLL a Fisher-scoring step may make and still be taken: rounding, not a rise
(a step refused for rounding alone would stop a row where the C library's last bit put it)."""
HALVINGS = 30
"""Step halvings tried to keep every bin expectation valid."""


@njit(cache=True)
def background_grid(log_1mx, log_x, w6, p1, p2, f, df1, df2):
    """Normalised background fractions f and df/dp1, df/dp2 (filled in place) for shape (p1, p2).

    exp(phi), phi = p1 ln(1-x) - p2 ln x at the Simpson nodes (scaled by its maximum), integrated
    per bin with Simpson's rule, also times ln(1-x) and -ln x (the derivatives)."""
    n_nodes = log_x.size
    phi_max = -np.inf
    for j in range(n_nodes):
        phi = p1 * log_1mx[j] - p2 * log_x[j]
        if phi > phi_max:
            phi_max = phi
    n_bins = w6.size
    total0 = total1 = total2 = 0.0
    e_lo = np.exp(p1 * log_1mx[0] - p2 * log_x[0] - phi_max)
    for i in range(n_bins):
        j = 2 * i
        e_mid = np.exp(p1 * log_1mx[j + 1] - p2 * log_x[j + 1] - phi_max)
        e_hi = np.exp(p1 * log_1mx[j + 2] - p2 * log_x[j + 2] - phi_max)
        b0 = w6[i] * (e_lo + 4.0 * e_mid + e_hi)
        b1 = w6[i] * (e_lo * log_1mx[j] + 4.0 * e_mid * log_1mx[j + 1] + e_hi * log_1mx[j + 2])
        b2 = w6[i] * (-e_lo * log_x[j] - 4.0 * e_mid * log_x[j + 1] - e_hi * log_x[j + 2])
        f[i], df1[i], df2[i] = b0, b1, b2
        total0 += b0
        total1 += b1
        total2 += b2
        e_lo = e_hi
    for i in range(n_bins):
        fi = f[i] / total0
        f[i] = fi
        df1[i] = (df1[i] - fi * total1) / total0
        df2[i] = (df2[i] - fi * total2) / total0


@njit(cache=True)
def _solve(a, b):
    """x with a x = b (small square a, vector b) by Gaussian elimination with partial pivoting, as
    LAPACK's gesv (``portable``'s); (x, False) where a pivot is exactly 0 (singular)."""
    x, ok = _solve_columns(a, b.copy().reshape(b.size, 1))
    return x[:, 0].copy(), ok


@njit(cache=True)
def _inverse_times(info, vectors):
    """info^-1 vectors (columns) by ``_solve``. Where info is singular (an exactly zero pivot: in
    practice a parameter the data say nothing about, such as the shape of a background of no
    events), the parameters whose diagonal is below 1e-15 of the largest are left out (their
    rows of the result are 0) and the rest is solved: what the pseudo-inverse gives when those
    rows and columns are zero; a system still singular gets no step (0)."""
    p, k = vectors.shape
    out = np.zeros((p, k))
    singular = False
    for c in range(k):
        x, ok = _solve(info, vectors[:, c].copy())
        out[:, c] = x
        singular = singular or not ok
    if not singular:
        return out
    scale = 0.0
    for q in range(p):
        scale = max(scale, abs(info[q, q]))
    keep = np.zeros(p, dtype=np.int64)  # the parameters kept, then their number
    n_keep = 0
    for q in range(p):
        if abs(info[q, q]) > 1e-15 * scale:
            keep[n_keep] = q
            n_keep += 1
    sub = np.empty((n_keep, n_keep))
    rhs = np.empty(n_keep)
    out[:, :] = 0.0
    for a in range(n_keep):
        for b in range(n_keep):
            sub[a, b] = info[keep[a], keep[b]]
    for c in range(k):
        for a in range(n_keep):
            rhs[a] = vectors[keep[a], c]
        x, ok = _solve(sub, rhs)
        if not ok:
            out[:, :] = 0.0
            return out
        for a in range(n_keep):
            out[keep[a], c] = x[a]
    return out


@njit(cache=True)
def hold_walls(solved, g, normals, on_wall):
    """The Newton step of a quadratic model that keeps the linear constraints ``normals`` . step
    >= 0 of those ``on_wall``: (step, decrement -g . step). ``solved`` (3, P) holds H^-1 g,
    H^-1 c_0, H^-1 c_1 (H the model's Hessian, c_j the rows of ``normals``).

    The free step -H^-1 g; where it would push a constraint on the wall outwards, for each
    subset of the walls on (one, the other, both) the step projected onto their face in the
    metric of H through their Lagrange multipliers (least squares of the 1 x 1 or 2 x 2 system
    C H^-1 C^T lam = C step); of those that push no other wall on outwards, the one with the
    largest decrement (the lowest model value): the exact minimiser of the model on the
    feasible cone. None feasible: no step. Used by the scan (``wall_step``) and the fits
    (``newton_direction``)."""
    p = g.size
    free_step = -solved[0]
    decrement = -vecdot(g, free_step)
    pushes_out = False
    for j in range(2):
        if on_wall[j] and vecdot(normals[j], free_step) < 0.0:
            pushes_out = True
    if not pushes_out:
        return free_step, decrement
    best = np.zeros(p)
    best_dec = -np.inf
    for subset in range(3):  # wall 0 held, wall 1 held, both (where both are on)
        if subset < 2 and not (on_wall[subset] and np.any(normals[subset] != 0.0)):
            continue
        if subset == 2 and not (on_wall[0] and on_wall[1] and np.any(normals != 0.0)):
            continue
        lam0 = lam1 = 0.0
        if subset < 2:
            a = vecdot(normals[subset], solved[1 + subset])
            lam = vecdot(normals[subset], free_step) / a if a != 0.0 else 0.0  # least squares of a lam = b
            if subset == 0:
                lam0 = lam
            else:
                lam1 = lam
        else:
            lam0, lam1 = _least_squares_2x2(
                vecdot(normals[0], solved[1]),
                vecdot(normals[0], solved[2]),
                vecdot(normals[1], solved[1]),
                vecdot(normals[1], solved[2]),
                vecdot(normals[0], free_step),
                vecdot(normals[1], free_step),
            )
        step = free_step - (solved[1] * lam0 + solved[2] * lam1)
        other = 1 - subset if subset < 2 else -1
        if other >= 0 and on_wall[other] and vecdot(normals[other], step) < 0.0:
            continue
        dec = -vecdot(g, step)
        if dec > best_dec:  # NaN is never taken
            best, best_dec = step, dec
    return best, max(best_dec, 0.0)


@njit(cache=True)
def wall_step(info, score, normals, on_wall):
    """One constrained Fisher-scoring step of ``scan._profile`` (the expected information
    ``info``, the NLL's gradient ``score``): (step (P,), Newton decrement), ``hold_walls``."""
    p = score.size
    columns = np.empty((p, 3))
    columns[:, 0] = score
    columns[:, 1] = normals[0]
    columns[:, 2] = normals[1]
    return hold_walls(np.ascontiguousarray(_inverse_times(info, columns).T), score, normals, on_wall)


@njit(cache=True)
def _row_deviance(counts, mu):
    """sum(mu - n + n ln(n / mu)): the row's NLL less a constant, summed term by term of order 1."""
    total = 0.0
    for i in range(counts.size):
        total += mu[i] - counts[i]
        if counts[i] > 0.0:
            total += counts[i] * np.log(counts[i] / mu[i])
    return total


@njit(cache=True)
def profile_rows(log_1mx, log_x, w6, slope_matrix, counts, starts, signal, free_signal, n_iter, positive):
    """Fisher scoring of (N_b, p1, p2[, N_s]) for each row of ``starts`` (K, 4) with the signal
    fractions ``signal`` (K, n_bins) (ignored unless ``free_signal``); see ``scan._profile``.

    Returns theta (K, 4), mu, f, df/dp1, df/dp2 (K, n_bins) at theta, and converged (K,)."""
    k_rows, n_bins = starts.shape[0], counts.size
    n_par = 4 if free_signal else 3
    theta = starts.copy()
    mu = np.empty((k_rows, n_bins))
    f = np.empty((k_rows, n_bins))
    df1 = np.empty((k_rows, n_bins))
    df2 = np.empty((k_rows, n_bins))
    converged = np.zeros(k_rows, dtype=np.bool_)
    normals = np.zeros((2, n_par))
    normals[:, 1:3] = slope_matrix
    jac = np.empty((n_par, n_bins))
    score = np.empty(n_par)
    info = np.empty((n_par, n_par))
    on_wall = np.empty(2, dtype=np.bool_)
    gap = np.empty(2)
    floor = np.empty(2)
    trial = np.empty(4)
    f_t, df1_t, df2_t, mu_t = np.empty(n_bins), np.empty(n_bins), np.empty(n_bins), np.empty(n_bins)
    for r in range(k_rows):
        if not free_signal:
            theta[r, 3] = 0.0
        for j in range(2):
            floor[j] = min(slope_matrix[j, 0] * theta[r, 1] + slope_matrix[j, 1] * theta[r, 2], 0.0) - WALL_GAP
        background_grid(log_1mx, log_x, w6, theta[r, 1], theta[r, 2], f[r], df1[r], df2[r])
        for i in range(n_bins):
            mu[r, i] = theta[r, 0] * f[r, i] + (theta[r, 3] * signal[r, i] if free_signal else 0.0)
        active, given_up = True, False
        deviance_now = _row_deviance(counts, mu[r])
        for _ in range(n_iter):
            if not active:
                break
            nb = theta[r, 0]
            for i in range(n_bins):
                jac[0, i] = f[r, i]
                jac[1, i] = nb * df1[r, i]
                jac[2, i] = nb * df2[r, i]
                if free_signal:
                    jac[3, i] = signal[r, i]
            score[:] = 0.0
            info[:, :] = 0.0
            for i in range(n_bins):
                mu_i = max(mu[r, i], 1e-300)  # an empty bin's expectation may underflow to 0
                resid = 1.0 - counts[i] / mu_i
                for p in range(n_par):
                    score[p] += jac[p, i] * resid
                    w = jac[p, i] / mu_i
                    for q in range(n_par):
                        info[p, q] += w * jac[q, i]
            for j in range(2):
                gap[j] = slope_matrix[j, 0] * theta[r, 1] + slope_matrix[j, 1] * theta[r, 2] - floor[j]
                on_wall[j] = gap[j] <= WALL_GAP
            step, decrement = wall_step(info, score, normals, on_wall)
            alpha = 1.0  # the longest step that keeps the constraints off the wall (they are linear)
            for j in range(2):
                slope_step = 0.0
                for q in range(n_par):
                    slope_step += step[q] * normals[j, q]
                if slope_step < 0.0 and not on_wall[j]:
                    alpha = min(alpha, -gap[j] / slope_step)
            alpha = max(alpha, 0.0)
            for halving in range(HALVINGS + 1):  # halve until every expectation is valid
                trial[:] = theta[r]
                for q in range(n_par):
                    trial[q] += alpha * step[q]
                background_grid(log_1mx, log_x, w6, trial[1], trial[2], f_t, df1_t, df2_t)
                valid = True
                for i in range(n_bins):
                    mu_t[i] = trial[0] * f_t[i] + (trial[3] * signal[r, i] if free_signal else 0.0)
                    if not (mu_t[i] > 0.0 or (mu_t[i] == 0.0 and counts[i] == 0.0)):
                        valid = False
                if valid:
                    deviance_trial = _row_deviance(counts, mu_t)
                    if deviance_trial <= deviance_now + NLL_RISE_TOLERANCE * (1.0 + abs(deviance_now)):
                        break
                if halving == HALVINGS:
                    valid = False
                    break
                alpha *= 0.5
            if not valid:  # no step along the direction lowers the NLL: as far as it goes
                active = False
                break
            theta[r] = trial
            mu[r], f[r], df1[r], df2[r] = mu_t, f_t, df1_t, df2_t
            deviance_now = deviance_trial
            active = decrement > CONVERGED_DECREMENT
            if positive and trial[3] <= 0.0:
                active, given_up = False, True
        converged[r] = not active and not given_up
    return theta, mu, f, df1, df2, converged


@njit(cache=True)
def deviance(
    par,
    log_1mx,
    log_x,
    w6,
    nodes,
    counts,
    mask,
    transform,
    p_ref,
    slope_matrix,
    spur,
    sigma,
    signal_free,
    signal_rows,
    gaussian,
    derivatives,
    shape_penalty,
    barrier,
):
    """``likelihood.PoissonDeviance``'s cost at ``par`` (its 7 parameters), and with
    ``derivatives`` its exact gradient and Hessian: (value, gradient (7,), Hessian (7, 7)); the
    derivatives are NaN where the cost is the barrier, empty without ``derivatives``.

    The background rows (f and its first and second derivatives in p1, p2) are computed here;
    the signal rows (s and its derivatives in mass and width, ``BinnedTemplate.signal_hessian``'s
    layout) too for a Gaussian (``gaussian``: width 0), else they are ``signal_rows`` (a Voigt,
    whose Faddeeva function scipy evaluates). The Hessian's formula is in
    ``PoissonDeviance.value_grad_hess``'s docstring; the background rows are f = b / B (b the bins'
    Simpson integrals of exp(phi), B their sum) and its derivatives in p1, p2."""
    nb, a1, a2, ns, m, th = par[0], par[1], par[2], par[3], par[4], par[6]
    t00, t01, t10, t11 = transform[0, 0], transform[0, 1], transform[1, 0], transform[1, 1]
    p1 = p_ref[0] + t00 * a1 + t01 * a2
    p2 = p_ref[1] + t10 * a1 + t11 * a2
    n_bins = w6.size
    # background: Simpson integrals of exp(phi) times 1, L1, L2, L1^2, L1 L2, L2^2 (L1 = ln(1-x), L2 = -ln x)
    phi_max = -np.inf
    for j in range(log_x.size):
        phi_max = max(phi_max, p1 * log_1mx[j] - p2 * log_x[j])
    bkg = np.empty((6, n_bins))
    totals = np.zeros(6)
    node = np.empty((3, 6))
    for i in range(n_bins):
        for k in range(3):
            j = 2 * i + k
            e = np.exp(p1 * log_1mx[j] - p2 * log_x[j] - phi_max)
            l1, l2 = log_1mx[j], -log_x[j]
            node[k, 0], node[k, 1], node[k, 2] = e, e * l1, e * l2
            node[k, 3], node[k, 4], node[k, 5] = e * (l1 * l1), e * (l1 * l2), e * (l2 * l2)
        for c in range(6):
            value = w6[i] * (node[0, c] + 4.0 * node[1, c] + node[2, c])
            bkg[c, i] = value
            totals[c] += value
    total, s1, s2, s11, s12, s22 = totals[0], totals[1], totals[2], totals[3], totals[4], totals[5]
    for i in range(n_bins):
        f = bkg[0, i] / total
        f1 = bkg[1, i] / total - f * (s1 / total)
        f2 = bkg[2, i] / total - f * (s2 / total)
        bkg[3, i] = bkg[3, i] / total - ((2.0 * s1 / total) * f1 + (s11 / total) * f)
        bkg[4, i] = bkg[4, i] / total - ((s1 / total) * f2 + (s2 / total) * f1 + (s12 / total) * f)
        bkg[5, i] = bkg[5, i] / total - ((2.0 * s2 / total) * f2 + (s22 / total) * f)
        bkg[0, i], bkg[1, i], bkg[2, i] = f, f1, f2
    sig = signal_rows
    if signal_free and gaussian:  # a Gaussian of width 0: s, ds/dm and d2s/dm2 (width rows 0)
        sig = np.zeros((6, n_bins))
        norm = 1.0 / (max(sigma, 1e-6) * np.sqrt(2.0 * np.pi))
        inv_var = 1.0 / max(sigma, 1e-6) ** 2
        for i in range(n_bins):
            for k in range(3):
                u = nodes[2 * i + k] - m
                g = np.exp(-0.5 * (u / max(sigma, 1e-6)) ** 2) * norm
                v = u * inv_var
                weight = w6[i] * (4.0 if k == 1 else 1.0)
                sig[0, i] += weight * g
                sig[1, i] += weight * (g * v)
                sig[3, i] += weight * (g * v * v - g * inv_var)
    amp = ns + th * spur
    mu = np.empty(n_bins)
    for i in range(n_bins):
        mu[i] = nb * bkg[0, i] + (amp * sig[0, i] if signal_free else 0.0)
    neg0 = min(slope_matrix[0, 0] * p1 + slope_matrix[0, 1] * p2, 0.0)
    neg1 = min(slope_matrix[1, 0] * p1 + slope_matrix[1, 1] * p2, 0.0)
    # the deviance, bin by bin (Baker-Cousins: terms of order 1, summed without cancellation); a
    # barrier where an expectation is negative, or 0 in a bin with events
    deviance_sum = 0.0
    outside = False
    violation = 0.0
    for i in range(n_bins):
        if mu[i] < 0.0 or (counts[i] > 0.0 and mu[i] <= 0.0):
            outside = True
        violation += max(-mu[i], 0.0)
        term = mu[i] * mask[i] - counts[i]
        if counts[i] > 0.0 and mu[i] > 0.0:
            term += counts[i] * np.log(counts[i] / mu[i])
        deviance_sum += term
    if outside:
        value = barrier * (1.0 + violation)
    else:
        value = 2.0 * deviance_sum + th * th
    value += shape_penalty * (neg0 * neg0 + neg1 * neg1)
    if not derivatives:
        return value, np.empty(0), np.empty((0, 0))
    grad = np.full(7, np.nan)
    hess = np.full((7, 7), np.nan)
    if value >= barrier:
        return value, grad, hess
    jac = np.zeros((7, n_bins))
    for i in range(n_bins):
        jac[0, i] = bkg[0, i]
        jac[1, i] = nb * (t00 * bkg[1, i] + t10 * bkg[2, i])
        jac[2, i] = nb * (t01 * bkg[1, i] + t11 * bkg[2, i])
        if signal_free:
            jac[3, i] = sig[0, i]
            jac[4, i] = amp * sig[1, i]
            jac[5, i] = amp * sig[2, i]
            jac[6, i] = spur * sig[0, i]
    grad[:] = 0.0
    hess[:, :] = 0.0
    r_b = np.zeros(5)
    r_s = np.zeros(5)
    for i in range(n_bins):
        mu_i = max(mu[i], 1e-100)  # where mu ~ 0 (no events there) the terms vanish; no overflow
        n_over_mu = counts[i] / mu_i
        r = mask[i] - n_over_mu
        weight = n_over_mu / mu_i
        for p in range(7):
            grad[p] += jac[p, i] * r
            for q in range(7):
                hess[p, q] += jac[p, i] * weight * jac[q, i]
        for k in range(5):
            r_b[k] += bkg[k + 1, i] * r
            if signal_free:
                r_s[k] += sig[k + 1, i] * r
    grad *= 2.0
    grad[6] += 2.0 * th
    wall = matmul(slope_matrix, transform)  # d(slopes at the window edges)/d(a1, a2)
    grad[1] += 2.0 * shape_penalty * (wall[0, 0] * neg0 + wall[1, 0] * neg1)
    grad[2] += 2.0 * shape_penalty * (wall[0, 1] * neg0 + wall[1, 1] * neg1)
    # sum_i r_i d2mu_i: N_b x shape, shape x shape (T^T [[f11, f12], [f12, f22]] T), signal terms
    curv = np.zeros((7, 7))
    curv[0, 1] = t00 * r_b[0] + t10 * r_b[1]
    curv[0, 2] = t01 * r_b[0] + t11 * r_b[1]
    second = np.array([[r_b[2], r_b[3]], [r_b[3], r_b[4]]])
    block = (0.5 * nb) * matmul(matmul(transform.T, second), transform)
    curv[1:3, 1:3] = block
    if signal_free:
        curv[3, 4], curv[3, 5] = r_s[0], r_s[1]
        curv[6, 4], curv[6, 5] = spur * r_s[0], spur * r_s[1]
        curv[4, 4], curv[4, 5], curv[5, 5] = 0.5 * amp * r_s[2], amp * r_s[3], 0.5 * amp * r_s[4]
    hess += curv + curv.T
    hess *= 2.0
    hess[6, 6] += 2.0
    for j, negative in ((0, neg0), (1, neg1)):
        if negative < 0.0:
            for a in range(2):
                for b in range(2):
                    hess[1 + a, 1 + b] += 2.0 * shape_penalty * wall[j, a] * wall[j, b]
    return value, grad, hess


@njit(cache=True)
def _held_wall_step(eigval, eigvec, g, normals, on_wall):
    """``hold_walls``'s step for H = eigvec diag(eigval) eigvec^T (``fitting._newton``)."""
    p = g.size
    rhs = np.empty((p, 3))
    rhs[:, 0] = g
    rhs[:, 1] = normals[0]
    rhs[:, 2] = normals[1]
    solved = np.ascontiguousarray(matmul(eigvec, matmul(eigvec.T, rhs) / eigval.reshape(p, 1)).T)  # H^-1 [g, c0, c1]
    return hold_walls(solved, g, normals, on_wall)[0]


@njit(cache=True)
def _least_squares_2x2(m00, m01, m10, m11, b0, b1):
    """The minimum-norm least-squares solution of [[m00, m01], [m10, m11]] lam = b (as LAPACK's
    gelsd with its default cut: singular values below 2 eps of the largest are 0; ``portable.svd``)."""
    m = np.array([[m00, m01], [m10, m11]])
    u, sv, vt = svd(m)
    cut = 2.0 * np.finfo(np.float64).eps * sv[0]
    lam = np.zeros(2)
    for k in range(2):
        if sv[k] > cut:
            coef = (u[0, k] * b0 + u[1, k] * b1) / sv[k]
            lam += coef * vt[k]
    return lam[0], lam[1]


BOUND_SNAP = 1e-12
"""A step's parameter within this of a bound, relative to the size of the numbers it was made from
(``onto_bounds``), is put on the bound: a step cut to reach a bound lands a few rounding errors
short of it (a yield of 5.7e-319 instead of 0), which leaves the bound inactive and the fit
stepping at denormals until it runs out of iterations, or not, as the last bits fall."""


@njit(cache=True)
def onto_bounds(x, step, lo, hi):
    """``x + step`` clipped to [``lo``, ``hi``], and put on a bound it is within ``BOUND_SNAP`` of
    (relative to ``|x| + |step|``)."""
    value = min(max(x + step, lo), hi)
    snap = BOUND_SNAP * (abs(x) + abs(step))
    if value - lo <= snap:
        return lo
    if hi - value <= snap:
        return hi
    return value


@njit(cache=True)
def newton_direction(g, h, xf, lo, hi, bounded, normals, on_wall):
    """The step of one ``fitting._newton`` iteration over the free parameters (gradient ``g``,
    Hessian ``h``, values ``xf`` within [``lo``, ``hi``]; ``bounded``: a parameter with a finite
    bound), before its length is cut.

    A parameter at a bound whose gradient points out is held there; the Newton step on the
    others uses the Hessian's eigenvalues in absolute value, floored at 1e-12 of the largest
    (``_held_wall_step`` keeps the walls); a parameter at a bound that this step would cross is
    held too, and the step recomputed (at most 2 n + 2 times)."""
    p = g.size
    at_lower = np.zeros(p, dtype=np.bool_)
    at_upper = np.zeros(p, dtype=np.bool_)
    held = np.zeros(p, dtype=np.bool_)
    for k in range(p):
        if bounded[k]:
            at_lower[k] = xf[k] <= lo[k]
            at_upper[k] = xf[k] >= hi[k]
            held[k] = (at_lower[k] and g[k] > 0.0) or (at_upper[k] and g[k] < 0.0)
    step = np.zeros(p)
    for _ in range(2 * p + 2):
        move = np.flatnonzero(~held)
        step = np.zeros(p)
        if move.size == 0:
            break
        sub = np.empty((move.size, move.size))
        for a in range(move.size):
            for b in range(move.size):
                sub[a, b] = h[move[a], move[b]]
        eigval, eigvec = eigh(sub)
        eigval = np.abs(eigval)
        eigval = np.maximum(eigval, 1e-12 * max(eigval.max(), 1e-300))
        sub_normals = np.empty((2, move.size))
        for a in range(move.size):
            sub_normals[:, a] = normals[:, move[a]]
        moved = _held_wall_step(eigval, eigvec, np.ascontiguousarray(g[move]), sub_normals, on_wall)
        for a in range(move.size):
            step[move[a]] = moved[a]
        blocked = False
        for k in range(p):
            if not held[k] and ((at_lower[k] and step[k] < 0.0) or (at_upper[k] and step[k] > 0.0)):
                held[k] = True
                blocked = True
        if not blocked:
            break
    return step


@njit(cache=True)
def newton_minimise(
    start,
    free,
    lo,
    hi,
    caps,
    max_iter,
    tol,
    wall_tol,
    wall,
    log_1mx,
    log_x,
    w6,
    nodes,
    counts,
    mask,
    transform,
    p_ref,
    slope_matrix,
    spur,
    sigma,
    signal_free,
    shape_penalty,
    barrier,
):
    """``fitting._newton`` for a cost whose signal is a Gaussian of width 0 (or absent): the same
    iterations, on ``deviance`` (its arguments after ``wall``, ``wall`` = slope_matrix @ transform,
    ``likelihood.PoissonDeviance.wall``), compiled whole. ``free``: the indices of the free
    parameters, within [``lo``, ``hi``], each step at most ``caps`` (inf: no cap). Returns
    (parameters (7,), cost, converged)."""
    no_rows = np.zeros((6, 0))

    def cost(par, derivatives):  # the fit's cost (with its gradient and Hessian)
        return deviance(
            par, log_1mx, log_x, w6, nodes, counts, mask, transform, p_ref, slope_matrix, spur, sigma,
            signal_free, no_rows, True, derivatives, shape_penalty, barrier,
        )  # fmt: skip

    p = free.size
    x = start.copy()
    bounded = np.empty(p, dtype=np.bool_)
    for k in range(p):
        bounded[k] = lo[k] > -np.inf or hi[k] < np.inf
    fval, g_all, h_all = cost(x, True)
    t00, t01, t10, t11 = transform[0, 0], transform[0, 1], transform[1, 0], transform[1, 1]
    g = np.empty(p)
    h = np.empty((p, p))
    xf = np.empty(p)
    normals = np.zeros((2, p))
    for k in range(p):
        if free[k] == 1 or free[k] == 2:
            normals[0, k] = wall[0, free[k] - 1]
            normals[1, k] = wall[1, free[k] - 1]
    on_wall = np.empty(2, dtype=np.bool_)
    for _ in range(max_iter):
        finite = True
        for a in range(p):
            g[a] = g_all[free[a]]
            xf[a] = x[free[a]]
            finite = finite and np.isfinite(g[a])
            for b in range(p):
                h[a, b] = h_all[free[a], free[b]]
                finite = finite and np.isfinite(h[a, b])
        if not finite:
            return x, fval, False
        p1 = p_ref[0] + t00 * x[1] + t01 * x[2]
        p2 = p_ref[1] + t10 * x[1] + t11 * x[2]
        slope = matvec(slope_matrix, np.array([p1, p2]))
        for j in range(2):
            on_wall[j] = slope[j] <= wall_tol
        step = newton_direction(g, h, xf, lo, hi, bounded, normals, on_wall)
        decrement = -vecdot(g, step)
        slope_step = matvec(normals, step)
        t_wall = 1.0  # the longest step that keeps the shapes off the wall inside it
        for j in range(2):
            if not on_wall[j] and slope_step[j] < 0.0:
                t_wall = min(t_wall, -slope[j] / slope_step[j])
        if t_wall < 1.0:
            step = t_wall * step
        descent = t_wall * decrement
        trial = x.copy()
        if decrement < tol:  # within ~decrement/2 of the minimum: take the last step if it helps
            for a in range(p):
                trial[free[a]] = onto_bounds(xf[a], step[a], lo[a], hi[a])
            ftrial = cost(trial, False)[0]
            if ftrial <= fval:
                return trial, ftrial, True
            return x, fval, True
        t = 1.0  # longest step inside the bounds and the trust region
        for a in range(p):
            d = step[a]
            if d < 0.0:
                t = min(t, (lo[a] - xf[a]) / d)
            elif d > 0.0:
                t = min(t, (hi[a] - xf[a]) / d)
            if d != 0.0:
                t = min(t, caps[a] / abs(d))
        for a in range(p):
            trial[free[a]] = onto_bounds(xf[a], t * step[a], lo[a], hi[a])
        ftrial, g_trial, h_trial = cost(trial, True)
        if not ftrial <= fval - 1e-4 * t * descent:
            found = False
            for _halving in range(60):
                t *= 0.5
                for a in range(p):
                    trial[free[a]] = onto_bounds(xf[a], t * step[a], lo[a], hi[a])
                ftrial = cost(trial, False)[0]
                if ftrial <= fval - 1e-4 * t * descent:
                    found = True
                    break
            if not found:
                return x, fval, decrement < 1e-4  # no descent left: converged to rounding
            ftrial, g_trial, h_trial = cost(trial, True)
        x, fval, g_all, h_all = trial, ftrial, g_trial, h_trial
    return x, fval, False
