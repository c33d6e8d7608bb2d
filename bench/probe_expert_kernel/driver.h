int main() {
  // inputs: random; reference: dequantized weights in double
  srand(7);
  int KW = KK / 8, KG = KK / GG;
  int rows = PP / RD;
  std::vector<float> x(rows * KK), scales(EE * OO * KG), biases(EE * OO * KG), out(PP * OO, NAN);
  std::vector<uint32_t> w(EE * OO * KW), experts(PP);
  for (auto& v : x) v = (rand() / (float)RAND_MAX) * 2 - 1;
  for (auto& v : scales) v = (rand() / (float)RAND_MAX) * 0.1f;
  for (auto& v : biases) v = (rand() / (float)RAND_MAX) * 0.2f - 0.1f;
  for (auto& v : w) v = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
  // each row of RD pairs: distinct experts
  for (int r = 0; r < PP / RD; ++r) {
    std::vector<int> pick(EE); for (int e = 0; e < EE; ++e) pick[e] = e;
    for (int j = 0; j < RD; ++j) { int s = j + rand() % (EE - j); std::swap(pick[j], pick[s]); experts[r * RD + j] = pick[j]; }
  }
  if (RD == 1) for (int p = 0; p < PP; ++p) experts[p] = rand() % EE;
  Shape es{{PP, 0, 0, 0}};
  blockDim.x = NTHREADS;
  for (int b = 0; b < NBLOCKS; ++b) {
    blockIdx.x = b;
    std::barrier<> bb(NTHREADS); block_barrier = &bb;
    std::vector<std::barrier<>*> wb; for (int i = 0; i < NTHREADS / 32; ++i) warp_barriers[i] = new std::barrier<>(32);
    std::vector<std::thread> ts;
    for (int t = 0; t < NTHREADS; ++t) ts.emplace_back([&, t] { threadIdx.x = t; kernel_body(x.data(), w.data(), scales.data(), biases.data(), experts.data(), es, out.data()); });
    for (auto& t : ts) t.join();
    for (int i = 0; i < NTHREADS / 32; ++i) delete warp_barriers[i];
  }
  double worst = 0; int unwritten = 0;
  for (int p = 0; p < PP; ++p) for (int o = 0; o < OO; ++o) {
    int e = experts[p]; const float* xr = &x[(p / RD) * KK];
    double acc = 0;
    for (int kk = 0; kk < KK; ++kk) {
      size_t row = (size_t)e * OO + o;
      uint32_t word = w[row * KW + kk / 8]; int q = (word >> (4 * (kk % 8))) & 15;
      double wv = q * (double)scales[row * KG + kk / GG] + biases[row * KG + kk / GG];
      acc += wv * xr[kk];
    }
    float got = out[p * OO + o];
    if (std::isnan(got)) { ++unwritten; continue; }
    worst = std::max(worst, std::fabs(got - acc) / (1.0 + std::fabs(acc)));
  }
  printf("K=%d O=%d G=%d per_row=%d experts=%d pairs=%d: unwritten %d, worst rel err %.2e\n", KK, OO, GG, RD, EE, PP, unwritten, worst);
  return unwritten != 0 || worst > 1e-4;
}
